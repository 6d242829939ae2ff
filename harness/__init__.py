"""What tests and benchmarks share, so that neither imports the other: the stack launcher
(``stack``), the fake engine and in-process proxy (``fake_engine``, ``live_proxy``), the load
driver, prompts of exact token lengths, and the engine and route helpers."""
