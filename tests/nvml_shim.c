/* A stand-in for the NVIDIA driver's libnvidia-ml.so.1, for tests on machines without a GPU.
 *
 * It exports exactly the C symbols nvidia-ml-py (pynvml) calls on det_lab's GPU source path, with
 * the argument and struct layouts pynvml declares for them; its GPUs and their processes are read
 * from the file named by NVML_SHIM_CONFIG at every nvmlInitWithFlags (so a test may change them
 * between scrapes). Lines of that file:
 *
 *   init_error CODE                        nvmlInitWithFlags returns CODE
 *   count_error CODE                       nvmlDeviceGetCount_v2 returns CODE
 *   gpu UUID UTIL MEMUTIL USED TOTAL NAME  a GPU (NAME may hold spaces: the rest of the line)
 *   proc PID BYTES                         a compute process of the last gpu; BYTES "-": not available
 *   power MILLIWATTS                       the last gpu's power draw (without it: not supported)
 *   reload                                 re-read this file at any device call once it has changed
 *                                          (a test scripts utilization over time by rewriting it)
 *
 * With NVML_SHIM_LOG set, every call appends its symbol name (and its result code) to that file.
 *
 * Build: gcc -shared -fPIC -o libnvidia-ml.so.1 nvml_shim.c
 * An older driver's library: -DSHIM_BEFORE_R510 (the processes call is _v2, not _v3: drivers before
 * R510), -DSHIM_WITHOUT_INIT_WITH_FLAGS (nvmlInit_v2, not the nvmlInitWithFlags nvidia-ml-py calls).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 8
#define MAX_PROCS 16
#define NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL /* NVML_VALUE_NOT_AVAILABLE_ulonglong */

/* pynvml: c_nvmlMemory_t */
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

/* pynvml: c_nvmlUtilization_t */
typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

/* pynvml: c_nvmlProcessInfo_v2_t (= _v3_t) */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_v3_t;

struct gpu {
    char uuid[96], name[96];
    nvmlUtilization_t util;
    unsigned long long used, total;
    unsigned int nprocs;
    nvmlProcessInfo_v3_t procs[MAX_PROCS];
    unsigned int power_mw;
    int has_power;
};
typedef struct gpu *nvmlDevice_t; /* opaque to the caller: a pointer into gpus[] */

static struct gpu gpus[MAX_GPUS];
static unsigned int ngpus;
static int initialised, count_error, reload;
static struct stat loaded; /* the config file as last read (for "reload") */

static nvmlReturn_t logged(const char *fn, nvmlReturn_t ret) {
    const char *path = getenv("NVML_SHIM_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (f) {
        fprintf(f, "%s %d\n", fn, ret);
        fclose(f);
    }
    return ret;
}

/* Reads the config; returns nvmlInitWithFlags' answer. */
static nvmlReturn_t load(void) {
    const char *path = getenv("NVML_SHIM_CONFIG");
    FILE *f = path ? fopen(path, "r") : NULL;
    char line[512], word[32], bytes[32];
    int init_error = 0;
    if (!f)
        return NVML_ERROR_UNKNOWN;
    fstat(fileno(f), &loaded);
    memset(gpus, 0, sizeof gpus);
    ngpus = 0;
    count_error = 0;
    reload = 0;
    while (fgets(line, sizeof line, f)) {
        struct gpu *g = ngpus ? &gpus[ngpus - 1] : NULL;
        if (sscanf(line, "%31s", word) != 1 || word[0] == '#')
            continue;
        if (!strcmp(word, "init_error")) {
            sscanf(line, "%*s %d", &init_error);
        } else if (!strcmp(word, "count_error")) {
            sscanf(line, "%*s %d", &count_error);
        } else if (!strcmp(word, "gpu") && ngpus < MAX_GPUS) {
            g = &gpus[ngpus];
            if (sscanf(line, "%*s %95s %u %u %llu %llu %95[^\n]", g->uuid, &g->util.gpu, &g->util.memory,
                       &g->used, &g->total, g->name) != 6)
                init_error = NVML_ERROR_UNKNOWN;
            ngpus++;
        } else if (!strcmp(word, "reload")) {
            reload = 1;
        } else if (!strcmp(word, "power") && g) {
            g->has_power = sscanf(line, "%*s %u", &g->power_mw) == 1;
        } else if (!strcmp(word, "proc") && g && g->nprocs < MAX_PROCS) {
            nvmlProcessInfo_v3_t *p = &g->procs[g->nprocs++];
            strcpy(bytes, "0");
            if (sscanf(line, "%*s %u %31s", &p->pid, bytes) != 2)
                init_error = NVML_ERROR_UNKNOWN;
            p->usedGpuMemory = strcmp(bytes, "-") ? strtoull(bytes, NULL, 10) : NOT_AVAILABLE;
            p->gpuInstanceId = p->computeInstanceId = 0xFFFFFFFF; /* not a MIG instance */
        } else {
            init_error = NVML_ERROR_UNKNOWN;
        }
    }
    fclose(f);
    return init_error;
}

/* With "reload": the config again once its file changed (a new file renamed over it, or rewritten). */
static void maybe_reload(void) {
    struct stat now;
    const char *path = getenv("NVML_SHIM_CONFIG");
    if (!reload || !path || stat(path, &now) != 0)
        return;
    if (now.st_ino != loaded.st_ino || now.st_size != loaded.st_size || now.st_mtim.tv_sec != loaded.st_mtim.tv_sec ||
        now.st_mtim.tv_nsec != loaded.st_mtim.tv_nsec)
        load();
}

static int valid(nvmlDevice_t d) {
    maybe_reload();
    return initialised && d >= gpus && d < gpus + ngpus;
}

static nvmlReturn_t init(const char *fn) {
    nvmlReturn_t ret = load();
    if (ret == NVML_SUCCESS)
        initialised++;
    return logged(fn, ret);
}

#ifdef SHIM_WITHOUT_INIT_WITH_FLAGS
nvmlReturn_t nvmlInit_v2(void) {
    return init(__func__);
}
#else
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return init(__func__);
}
#endif

#ifdef SHIM_BEFORE_R510
#define COMPUTE_PROCESSES nvmlDeviceGetComputeRunningProcesses_v2 /* same struct as _v3 */
#else
#define COMPUTE_PROCESSES nvmlDeviceGetComputeRunningProcesses_v3
#endif

nvmlReturn_t nvmlShutdown(void) {
    if (!initialised)
        return logged(__func__, NVML_ERROR_UNINITIALIZED);
    initialised--;
    return logged(__func__, NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised)
        return logged(__func__, NVML_ERROR_UNINITIALIZED);
    if (count_error)
        return logged(__func__, count_error);
    *count = ngpus;
    return logged(__func__, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialised)
        return logged(__func__, NVML_ERROR_UNINITIALIZED);
    if (index >= ngpus || !device)
        return logged(__func__, NVML_ERROR_INVALID_ARGUMENT);
    *device = &gpus[index];
    return logged(__func__, NVML_SUCCESS);
}

static nvmlReturn_t copy_string(const char *fn, nvmlDevice_t d, const char *s, char *out, unsigned int length) {
    if (!valid(d) || !out)
        return logged(fn, NVML_ERROR_INVALID_ARGUMENT);
    if (strlen(s) + 1 > length)
        return logged(fn, NVML_ERROR_INSUFFICIENT_SIZE);
    strcpy(out, s);
    return logged(fn, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    return copy_string(__func__, device, valid(device) ? device->uuid : "", uuid, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    return copy_string(__func__, device, valid(device) ? device->name : "", name, length);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    if (!valid(device) || !utilization)
        return logged(__func__, NVML_ERROR_INVALID_ARGUMENT);
    *utilization = device->util;
    return logged(__func__, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (!valid(device) || !memory)
        return logged(__func__, NVML_ERROR_INVALID_ARGUMENT);
    memory->total = device->total;
    memory->used = device->used;
    memory->free = device->total - device->used;
    return logged(__func__, NVML_SUCCESS);
}

/* As the driver: with too small an array (or none), the count needed and INSUFFICIENT_SIZE. */
nvmlReturn_t COMPUTE_PROCESSES(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_v3_t *infos) {
    if (!valid(device) || !infoCount)
        return logged(__func__, NVML_ERROR_INVALID_ARGUMENT);
    if (*infoCount < device->nprocs || (!infos && device->nprocs)) {
        *infoCount = device->nprocs;
        return logged(__func__, NVML_ERROR_INSUFFICIENT_SIZE);
    }
    *infoCount = device->nprocs;
    if (device->nprocs)
        memcpy(infos, device->procs, device->nprocs * sizeof *infos);
    return logged(__func__, NVML_SUCCESS);
}

/* milliwatts, as the driver; NOT_SUPPORTED for a GPU without a "power" line */
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    if (!valid(device) || !power)
        return logged(__func__, NVML_ERROR_INVALID_ARGUMENT);
    if (!device->has_power)
        return logged(__func__, NVML_ERROR_NOT_SUPPORTED);
    *power = device->power_mw;
    return logged(__func__, NVML_SUCCESS);
}
