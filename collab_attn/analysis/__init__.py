"""Looking inside: energy spectra, parameter / FLOP accounting, attention views (BertViz), plots."""
