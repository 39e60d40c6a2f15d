"""What vLLM's own processes run, in vLLM's virtualenv (``make vllm``): rlstream's worker
extension (``rlstream_vllm_ext``, put on the server's ``PYTHONPATH`` by ``rollout.vllm_process``;
it imports nothing of rlstream) and the requirements of that virtualenv."""
