"""The deep-learning frameworks ddlf drives: Keras' backend choice, loading order, seeding, and PyTorch models."""
