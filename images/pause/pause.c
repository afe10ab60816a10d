/*
 * The pod sandbox's process (containerd's CRI `sandbox_image`), built static with
 *   gcc -static -Os -s -o pause pause.c
 * by hack/localcluster/images.py. It holds the pod's namespaces open: it sleeps until
 * SIGTERM or SIGINT (exit status 0) and, being PID 1 of a shared PID namespace, reaps every
 * child that is re-parented to it, so an exited orphan never stays a zombie.
 *
 * As PID 1, signals without a handler are ignored by the kernel, hence explicit handlers.
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stop_signal;

static void on_stop(int sig) { stop_signal = sig; }

static void on_child(int sig) {
    (void)sig;
    int saved = errno;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

static int install(int sig, void (*handler)(int)) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sa.sa_flags = SA_RESTART | (sig == SIGCHLD ? SA_NOCLDSTOP : 0);
    sigemptyset(&sa.sa_mask);
    return sigaction(sig, &sa, NULL);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        static const char version[] = "sftjob pause 3.10\n";
        return write(STDOUT_FILENO, version, sizeof version - 1) < 0;
    }
    if (install(SIGTERM, on_stop) || install(SIGINT, on_stop) || install(SIGCHLD, on_child)) {
        static const char msg[] = "pause: sigaction failed\n";
        (void)!write(STDERR_FILENO, msg, sizeof msg - 1);
        return 1;
    }
    /* The signals stay blocked except inside sigsuspend(), so one that arrives between the
     * test of stop_signal and the wait is not lost. */
    sigset_t blocked, waiting;
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGTERM);
    sigaddset(&blocked, SIGINT);
    sigaddset(&blocked, SIGCHLD);
    sigprocmask(SIG_BLOCK, &blocked, &waiting);
    sigdelset(&waiting, SIGTERM);
    sigdelset(&waiting, SIGINT);
    sigdelset(&waiting, SIGCHLD);
    /* Children that exited before the handler was installed. */
    on_child(SIGCHLD);
    while (!stop_signal)
        sigsuspend(&waiting);
    return 0;
}
