"""The simulator: goodput and cost of a job through a failure trace, per recovery strategy
(`elastrain sim`; a tool, which the training core never imports)."""
