"""Entry point of rule extract_shard (not implemented yet)."""
raise NotImplementedError("extract_shard")
