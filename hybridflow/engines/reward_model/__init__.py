"""Reward-model engines: the rows a reward model reads (inputs.py), transformers (hf.py), vLLM's pooling runner
(vllm.py, imported only when used)."""
