"""Does a planted defect change behaviour? Tiny-tensor probes of each upstream source (see __main__)."""
