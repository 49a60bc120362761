"""Beyond one process, on torch.distributed and torch's elastic launcher (no transport or scheduler of mlight's own)."""
