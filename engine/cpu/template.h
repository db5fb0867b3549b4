/* template.h — instantiates a kernel file's generic section twice, for
 * float and for double.  A kernel file defines GL_TEMPLATE as its own name
 * and includes this header; its generic section (under `#ifdef real`) uses
 * `real` (the compute type), RDT (its gl_dtype) and R(name) (a name with the
 * type's suffix, e.g. R(softmax) -> softmax_f32), and #undefs all three at
 * its end.  No include guard: each kernel file includes it once. */
#define real float
#define RDT GL_F32
#define R(name) name##_f32
#include GL_TEMPLATE
#define real double
#define RDT GL_F64
#define R(name) name##_f64
#include GL_TEMPLATE
#undef GL_TEMPLATE
