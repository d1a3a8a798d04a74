"""Entry point of rule regenerate (not implemented yet)."""
raise NotImplementedError("regenerate")
