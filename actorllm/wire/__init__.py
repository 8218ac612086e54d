"""What actors send and how it travels: messages, mailboxes, the ZeroMQ transport and
its codec, and where processes meet. Shared ground: no actor owns it.
"""
