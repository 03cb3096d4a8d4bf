"""The stage layer: the stage runners, the CLI's recipe, the native MODEL's engine, distributed text encoding, media."""
