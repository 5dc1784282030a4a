"""What ckrun keeps on disk: files written whole, a directory's lock, checkpoint files, the user cache."""
