"""What vLLM's own processes run, in vLLM's virtualenv (``make vllm``): rlstream's weight-transfer
backend (the package ``rlstream_vllm``, installed there from this folder's ``pyproject.toml``;
it imports nothing of rlstream) and the requirements of that virtualenv."""
