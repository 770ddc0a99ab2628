"""The engine: continuous batching (engine), requests (scheduler) and their checks (intake), and the worker that
runs one step at a time, composed of prefill, plain and speculative rounds and the overlap schedule. Tokenisation
stays outside (fastspec.llm); the engine speaks token ids."""
