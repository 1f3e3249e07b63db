"""The actor tier: the runtime and real actors wired over real ZeroMQ sockets, in one
process or several, with stand-ins (tests/actors/fake_engine_actors.py) where a model would
be. No model, no torch. Shared actors live in tests/actors/probe_actors.py, an importable
module, so that spawned child processes can build them."""
