"""`bulkinfer tune`: engine settings measured for one model on one machine."""
