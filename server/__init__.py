"""HTTP serving of BitFit patches: settings, the batched multi-task engine, the FastAPI app."""
