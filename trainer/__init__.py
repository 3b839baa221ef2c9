"""Training BitFit patches: data readers, train_patch, the queue worker."""
