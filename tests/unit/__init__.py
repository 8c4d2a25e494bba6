"""In-process tests: the engine, the store, the adapters against fakes in the same process, the
router, the scheduler, config, rendering. A file that also has a test or two of a geodebot
subprocess lives here when most of its tests are in-process (test_mcp_hardening, test_sdnotify).
"""
