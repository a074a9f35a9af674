"""End-to-end tests on a real vLLM engine (CPU platform), marked ``e2e``."""
