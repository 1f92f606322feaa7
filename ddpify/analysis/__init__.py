"""The shared script model: what the model, loaders, samplers, guards ... of a script are."""
