"""The stores: Optuna's storage, MLflow's tracking, their URLs without passwords, and how a trial can end in both."""
