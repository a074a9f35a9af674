"""Engine adapters, imported as ``kvxfer.adapters`` (``kvxfer.adapters.vllm``)."""
