"""Hugging Face checkpoint directories (Llama, Mistral, Qwen2, Gemma 2) as the serving model:
`config` (config.json), `weights` (safetensors), `tokenizer` (tokenizer.json), and
`checkpoint`, which loads all three."""
