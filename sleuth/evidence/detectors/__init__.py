"""Source detectors, one module per area of the DFlash rules; each yields CodeReadings from an Analyzer."""
