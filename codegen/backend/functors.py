"""C++ names of the epilogue's compute functors (defined in ``templates.PRELUDE``)."""
from ..ir import OpKind, ReduceFn

FUNCTOR = {
    OpKind.ADD: "tvm_evt::Add",
    OpKind.SUB: "tvm_evt::Sub",
    OpKind.MUL: "tvm_evt::Mul",
    OpKind.DIV: "tvm_evt::Div",
    OpKind.MAX: "tvm_evt::Max",
    OpKind.MIN: "tvm_evt::Min",
    OpKind.NEG: "tvm_evt::Neg",
    OpKind.EXP: "tvm_evt::Exp",
    OpKind.LOG: "tvm_evt::Log",
    OpKind.TANH: "tvm_evt::Tanh",
    OpKind.ERF: "tvm_evt::Erf",
    OpKind.SIGMOID: "tvm_evt::Sigmoid",
    OpKind.RELU: "tvm_evt::Relu",
    OpKind.GELU: "tvm_evt::Gelu",
    OpKind.GELU_TANH: "tvm_evt::GeluTanh",
    OpKind.SILU: "tvm_evt::Silu",
    OpKind.CAST: "tvm_evt::Identity",
    OpKind.GELU_GRAD: "tvm_evt::GeluGrad",
    OpKind.GELU_TANH_GRAD: "tvm_evt::GeluTanhGrad",
    OpKind.RELU_BACKWARD: "tvm_evt::ReluBackward",
    OpKind.GELU_BACKWARD: "tvm_evt::GeluBackward",
    OpKind.GT: "tvm_evt::Gt",
    OpKind.GE: "tvm_evt::Ge",
    OpKind.LT: "tvm_evt::Lt",
    OpKind.LE: "tvm_evt::Le",
    OpKind.EQ: "tvm_evt::Eq",
    OpKind.NE: "tvm_evt::Ne",
    OpKind.AND: "tvm_evt::And",
    OpKind.OR: "tvm_evt::Or",
    OpKind.WHERE: "tvm_evt::Where",
}

# (register/shuffle reduce, final gmem reduce for row/col, atomic gmem reduce for scalar, identity)
REDUCE = {
    ReduceFn.SUM: ("cutlass::plus", "cutlass::plus", "cutlass::atomic_add", "0.0f"),
    ReduceFn.MAX: (
        "cutlass::maximum",
        "cutlass::maximum",
        "cutlass::atomic_maximum",
        "-cutlass::platform::numeric_limits<float>::infinity()",
    ),
}

CPP_TYPE = {
    "float16": "cutlass::half_t",
    "bfloat16": "cutlass::bfloat16_t",
    "float32": "float",
    "bool": "uint8_t",
    "uint32": "uint32_t",
}

# DLPack (type code, bits) of each dtype, for the entry's argument checks
DL_TYPE = {
    "float16": ("kDLFloat", 16),
    "bfloat16": ("kDLBfloat", 16),
    "float32": ("kDLFloat", 32),
    "bool": ("kDLBool", 8),
    "uint32": ("kDLUInt", 32),
}

BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "bool": 8, "uint32": 32}
