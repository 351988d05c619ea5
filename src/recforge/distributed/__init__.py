"""Training across processes: tables sharded over a device mesh (issue 19)."""
