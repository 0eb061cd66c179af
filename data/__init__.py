"""pylon.data: Ray Data pipelines (shard writers and readers, tokenizers, packing, resumable iteration)."""
