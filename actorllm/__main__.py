"""``python -m actorllm`` is the ``actorllm`` command."""

import sys

from actorllm.cli import main

sys.exit(main())
