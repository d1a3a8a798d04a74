"""Entry point of rule export (not implemented yet)."""
raise NotImplementedError("export")
