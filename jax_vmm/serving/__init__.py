"""Serving on jax_vmm: a continuous-batching engine, a Llama/Mistral/Qwen2 model and a
Hugging Face checkpoint loader, written on jax_vmm's public API only.

Install its dependencies with `pip install 'jax_vmm[serving]'`. Nothing is imported here:
`import jax_vmm.serving.engine` etc. pulls in what it needs, and the optional packages
(tqdm, safetensors, tokenizers) only where they are used (`_optional.require`).

    model            the decoder (config, weights, prefill and decode step), model presets
    attention        decode attention: plain-JAX reference, cuDNN, jax_vmm's kernel
    cache            the two KV-cache backends (jax_vmm arena, preallocated arrays)
    steps            the jitted prefill and block-of-decode-steps programs
    run_data         what a run takes and gives back: Request; Result, StepRecord, RunReport
    serving_loop     one run's host loop: admit, prefill, ensure, decode blocks, read, release
    engine           continuous batching over a cache backend (Generator, Request)
    sampling         greedy, temperature, top-k, top-p token choice per request
    generate         text in, text out with a Hugging Face checkpoint
    tensor_parallel  heads and MLP split over devices, the KV cache over KV heads
    sleep_wake       sleeping and waking the engine's arenas while it serves
    hf               checkpoint directories: config.json, safetensors, tokenizer.json
    memory, report, summary   measurements, formatting and the demo's summary
    cli              the command lines behind examples/decode.py and examples/generate.py
"""
