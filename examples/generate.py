"""Generate text with a Hugging Face checkpoint (Llama, Mistral, Qwen2, Gemma 2) on the
jax_vmm cache.

    python examples/generate.py --model DIR --prompt "text" --max-new-tokens N

`--help` lists every option. The checkpoint loader, engine and sampling are
`jax_vmm.serving` (`pip install '.[example]'`); this script is its command line,
`jax_vmm.serving.cli.generate`.
"""

import contextlib

from jax_vmm.serving.cli import generate

if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):  # `... | head` ends the output early
        generate.main()
