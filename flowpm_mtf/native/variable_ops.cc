// A resource variable's buffer handed to the op that computes the variable's next value.
//
// Op (the Python side is flowpm_mtf/donate.py, which documents its use):
//
//   FlowpmTakeVariable(resource) -> T shape
//       The variable's value, moved out: the output holds the only reference to the
//       buffer that the variable held (unless a read of the variable still holds it
//       too), and the variable is left uninitialised as TensorFlow's graph-mode resource
//       variables are before their initializer: its resource is deleted from the resource
//       manager, so a read raises FailedPrecondition ("Could not find variable") and the
//       next AssignVariableOp creates it again. (`Var::Uninitialize` would not do: a read
//       would return its moved-from tensor, a shape without a buffer, and abort.) Graph
//       mode only: a ref-counting (eager) handle is refused.
//
// Why: an op that writes a variable's next value allocates a fresh output, and the
// assignment then frees the variable's old buffer. Where the old value is not needed
// (the job's ICs replace the initial zeros of the state), a consumer that takes this
// output over (`forward_input`) writes into memory the process has already touched: at
// 512^3 the ICs' positions and momenta (3.2 GB) are no longer first-touched pages.
//
// The value is the variable's: a consumer that cannot take it over reads it as any
// input. A failed session run after the take leaves the variable uninitialised (a read
// of it raises FailedPrecondition): the job's ICs run re-initialises it from the start.
#include <string>

#include "tensorflow/core/framework/resource_handle.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tf_op.h"

namespace {

using ::tensorflow::DataType;
using ::tensorflow::PartialTensorShape;
using ::tensorflow::Var;

class TakeVariableOp : public OpKernel {
 public:
  explicit TakeVariableOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shape", &shape_));
  }

  void Compute(OpKernelContext* ctx) override {
    const ::tensorflow::ResourceHandle& handle = ::tensorflow::HandleFromInput(ctx, 0);
    OP_REQUIRES(ctx, !handle.IsRefCounting(),
                InvalidArgument("FlowpmTakeVariable: the variable ", handle.name(),
                                " has a ref-counting (eager) handle; graph mode only"));
    ::tensorflow::core::RefCountPtr<Var> var;
    const auto found = ::tensorflow::LookupResource(ctx, handle, &var);
    OP_REQUIRES(ctx, found.ok(),
                ::tensorflow::errors::FailedPrecondition(
                    "FlowpmTakeVariable: the variable ", handle.name(),
                    " is not initialised (", found.message(), ")"));
    Tensor value;
    {
      ::tensorflow::mutex_lock lock(*var->mu());
      OP_REQUIRES(ctx, var->is_initialized,
                  ::tensorflow::errors::FailedPrecondition(
                      "FlowpmTakeVariable: the variable ", handle.name(),
                      " is not initialised"));
      const Tensor& held = *var->tensor();
      OP_REQUIRES(ctx, held.dtype() == dtype_,
                  InvalidArgument("FlowpmTakeVariable: the variable ", handle.name(),
                                  " holds ", ::tensorflow::DataTypeString(held.dtype()),
                                  ", not ", ::tensorflow::DataTypeString(dtype_)));
      OP_REQUIRES(ctx, shape_.IsCompatibleWith(held.shape()),
                  InvalidArgument("FlowpmTakeVariable: the variable ", handle.name(),
                                  " has the shape ", held.shape().DebugString(), ", not ",
                                  shape_.DebugString()));
      value = held;
      // the variable's reference dropped; an empty value for a read that looked the
      // variable up before the deletion below (none in a graph that orders its reads
      // before the take, as flowpm_mtf/donate.py does)
      *var->tensor() = Tensor(dtype_, TensorShape({0}));
      var->is_initialized = false;
    }
    OP_REQUIRES_OK(ctx, ::tensorflow::DeleteResource<Var>(ctx, handle));
    ctx->set_output(0, value);
  }

 private:
  DataType dtype_;
  PartialTensorShape shape_;
};

}  // namespace

REGISTER_OP("FlowpmTakeVariable")
    .Input("resource: resource")
    .Output("value: dtype")
    .Attr("dtype: type")
    .Attr("shape: shape")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ::tensorflow::PartialTensorShape shape;
      TF_RETURN_IF_ERROR(c->GetAttr("shape", &shape));
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shape, &out));
      c->set_output(0, out);
      return ::tensorflow::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("FlowpmTakeVariable").Device(DEVICE_CPU), TakeVariableOp);
