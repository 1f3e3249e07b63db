"""The unit tier: pure code (kvcore, the scheduler policy, the codec, config, the audit).

No sockets, no actors, no torch, no model: every test runs in milliseconds, and collecting
this tier imports none of them.
"""
