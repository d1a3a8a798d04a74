"""Entry point of rule tokenize (not implemented yet)."""
raise NotImplementedError("tokenize")
