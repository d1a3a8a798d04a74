"""Entry point of rule fetch_dataset (not implemented yet)."""
raise NotImplementedError("fetch_dataset")
