"""Entry point of rule materialize_target (not implemented yet)."""
raise NotImplementedError("materialize_target")
