"""Demo pieces that are not the library: the demo Llama model, its GPU worker actor and
the demo Serve app. They need the `demo` (transformers) and `serve` extras."""
