"""Entry point of rule extract_plan (not implemented yet)."""
raise NotImplementedError("extract_plan")
