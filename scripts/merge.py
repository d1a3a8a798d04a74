"""Entry point of rule merge (not implemented yet)."""
raise NotImplementedError("merge")
