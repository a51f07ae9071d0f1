"""The command lines of the examples: `decode` (examples/decode.py, random weights) and
`generate` (examples/generate.py, a Hugging Face checkpoint). Each has `main(argv)`."""
