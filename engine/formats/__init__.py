"""Number formats both the front and the kernels read: the q8 activation quantizer, MXFP4's blocks."""
