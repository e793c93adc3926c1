"""wide_tessera's measurements put to work inside other libraries' models (transformers)."""
