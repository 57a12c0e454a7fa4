"""Measuring harnesses the CLI runs against kvlab itself: `kvlab loadtest` (a server under
concurrent streams), `kvlab bench` (llama-bench-style prefill and decode runs) and `kvlab
kv-quality` (what a smaller KV cache costs in KL divergence). They print figures; the
peer-comparison scripts at the top of the repository (`bench/`) are apart from them."""
