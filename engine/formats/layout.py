"""The block formats' layouts, what the front's stores, the q8 quantizer and the kernels all read: values and bytes a
block, and where in a block its f16 scales lie."""

# GGUF's block formats: name -> (values a block, bytes a block), the layouts of gguf.GGML_QUANT_SIZES. A tensor of
# logical shape (rows, cols) is held as uint8 (rows, cols / values * bytes), each row's blocks in turn.
BLOCK_FORMATS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_k": (256, 144), "q6_k": (256, 210), "mxfp4": (32, 17),
                 "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q5_k": (256, 176), "q3_k": (256, 110),
                 "q2_k": (256, 84), "iq4_nl": (32, 18), "iq4_xs": (256, 136)}
F16_SCALES = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,), "mxfp4": (), "q4_1": (0, 2), "q5_0": (0,),
              "q5_1": (0, 2), "q5_k": (0, 2), "q3_k": (108,), "q2_k": (80, 82), "iq4_nl": (0,),
              "iq4_xs": (0,)}  # a block's f16 scales' bytes (engine/formats/blocks.py holds the same tables)
# (mxfp4's scale is one e8m0 byte, at 0)
