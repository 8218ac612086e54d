"""The deterministic simulation harness (DESIGN.md §7): real actors, a scripted Worker, a
transport whose delivery order the test chooses, and checks for every invariant of §3.

Import as ``from sim import ...`` from tests (``tests/`` is on ``sys.path`` there).
"""

from .common import EDGES, InvariantViolation, SimConfig, TextModel
from .controlled_transport import ControlledMailbox, EdgeOutbox
from .machine import LifecycleMachine, make_machine
from .scripted_worker import ScriptedWorker
from .world import World

__all__ = [
    "EDGES",
    "ControlledMailbox",
    "EdgeOutbox",
    "InvariantViolation",
    "LifecycleMachine",
    "ScriptedWorker",
    "SimConfig",
    "TextModel",
    "World",
    "make_machine",
]
