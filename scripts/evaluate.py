"""Entry point of rule evaluate (not implemented yet)."""
raise NotImplementedError("evaluate")
