"""One module per step of the flow; `base.StepScreen` holds what they share."""
