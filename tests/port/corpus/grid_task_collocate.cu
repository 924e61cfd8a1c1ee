// A density-collocation task staged in shared memory: the per-task block copies its descriptor, then each
// thread adds its share of the Gaussian products into the grid.
#include <cuda_runtime.h>

struct grid_task_base {
  int first_coef;
  int la_max, lb_max;
  double zeta, zetb;
};

typedef struct : grid_task_base {  // expect: typedef-anonymous-struct
  double zetp;
  double rp[3];
} smem_task;

__global__ void collocate(const grid_task_base* tasks, const double* coefs, double* grid, int grid_size) {
  __shared__ smem_task task;
  if (threadIdx.x == 0) {
    task.first_coef = tasks[blockIdx.x].first_coef;
    task.zeta = tasks[blockIdx.x].zeta;
    task.zetb = tasks[blockIdx.x].zetb;
    task.zetp = task.zeta + task.zetb;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < grid_size; i += blockDim.x) {
    atomicAdd(&grid[i], coefs[task.first_coef] * exp(-task.zetp * i));
  }
}
