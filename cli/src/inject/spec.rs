//! What injection adds to a Pod, written once as data. `render` evaluates it in Rust for
//! `rebound inject`; `policy` compiles the same data to CEL for the admission policies, so
//! the CLI and the API server cannot drift apart.

/// The annotation (or namespace label value `enabled`) that asks for injection.
pub const INJECT: &str = "rebound.dev/inject";
/// The namespace label that injects every Pod of the namespace not opted out.
pub const NAMESPACE_LABEL: &str = "rebound.dev/inject";
/// Set on injected Pods; also what stops a second injection.
pub const INJECTED_LABEL: &str = "rebound.dev/injected";
/// The sidecar image an injected Pod got, for `kubectl rebound check` after upgrades.
pub const IMAGE_ANNOTATION: &str = "rebound.dev/sidecar-image";
/// The sidecar's container name (first init container).
pub const SIDECAR: &str = "rebound-sidecar";
/// The socket volume shared with the app containers.
pub const SOCKET_VOLUME: &str = "rebound-socket";
pub const SOCKET_DIR: &str = "/run/rebound";
pub const UNIX_TARGET: &str = "unix:///run/rebound/rebound.sock";
pub const TCP_TARGET: &str = "127.0.0.1:7411";
pub const TARGET_ENV: &str = "REBOUND_TARGET";
/// The parameter ConfigMap the chart owns, in the chart's namespace.
pub const PARAMS_CONFIGMAP: &str = "rebound-injection";

/// One resolved value: a per-Pod annotation wins over the parameter, which wins over the
/// default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Var {
    Image,
    ConfigMap,
    LogLevel,
    CpuRequest,
    MemoryRequest,
    MemoryLimit,
    Mode,
    Transport,
    Metrics,
}

/// Where a [`Var`] comes from, and what an annotation overriding it must look like.
pub struct Setting {
    pub var: Var,
    /// The CEL variable name (`variables.<name>`).
    pub name: &'static str,
    pub annotation: Option<&'static str>,
    /// Key in the parameter ConfigMap's `data`.
    pub param: Option<&'static str>,
    pub default: &'static str,
    /// RE2 syntax (Rust's regex and CEL's `matches` agree on it); the whole value.
    pub pattern: &'static str,
    pub expected: &'static str,
}

const QUANTITY: &str = r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$";
const QUANTITY_TEXT: &str = "a Kubernetes quantity such as 10m, 16Mi or 0.5";

pub const SETTINGS: [Setting; 9] = [
    Setting {
        var: Var::Image,
        name: "image",
        annotation: None,
        param: Some("image"),
        default: "",
        pattern: "",
        expected: "",
    },
    Setting {
        var: Var::ConfigMap,
        name: "configMap",
        annotation: Some("rebound.dev/configmap"),
        param: Some("configMapName"),
        default: "rebound-policies",
        pattern: r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
        expected: "a ConfigMap name (lower-case letters, digits and '-', at most 63)",
    },
    Setting {
        var: Var::LogLevel,
        name: "logLevel",
        annotation: Some("rebound.dev/log-level"),
        param: Some("logLevel"),
        default: "info",
        pattern: "^(error|warn|info|debug|trace)$",
        expected: "one of error, warn, info, debug, trace",
    },
    Setting {
        var: Var::CpuRequest,
        name: "cpuRequest",
        annotation: Some("rebound.dev/sidecar-cpu-request"),
        param: Some("cpuRequest"),
        default: "10m",
        pattern: QUANTITY,
        expected: QUANTITY_TEXT,
    },
    Setting {
        var: Var::MemoryRequest,
        name: "memoryRequest",
        annotation: Some("rebound.dev/sidecar-memory-request"),
        param: Some("memoryRequest"),
        default: "16Mi",
        pattern: QUANTITY,
        expected: QUANTITY_TEXT,
    },
    Setting {
        var: Var::MemoryLimit,
        name: "memoryLimit",
        annotation: Some("rebound.dev/sidecar-memory-limit"),
        param: Some("memoryLimit"),
        default: "64Mi",
        pattern: QUANTITY,
        expected: QUANTITY_TEXT,
    },
    Setting {
        var: Var::Mode,
        name: "mode",
        annotation: Some("rebound.dev/mode"),
        param: Some("mode"),
        default: "watch",
        pattern: "^(file|watch)$",
        expected: "file or watch",
    },
    Setting {
        var: Var::Transport,
        name: "transport",
        annotation: Some("rebound.dev/transport"),
        param: None,
        default: "unix",
        pattern: "^(unix|tcp)$",
        expected: "unix or tcp",
    },
    // Off by default: the admin port listens on the Pod IP, and /metrics names the
    // namespace's policies to anything that reaches it.
    Setting {
        var: Var::Metrics,
        name: "metrics",
        annotation: Some("rebound.dev/metrics"),
        param: Some("metrics"),
        default: "false",
        pattern: "^(true|false)$",
        expected: "\"true\" or \"false\"",
    },
];

/// The check of `rebound.dev/inject` itself: a typo must not silently skip injection.
pub const INJECT_PATTERN: &str = "^(true|false)$";
pub const INJECT_EXPECTED: &str = "\"true\" or \"false\"";

/// Every `rebound.dev/*` annotation a Pod may carry; any other is refused.
pub fn known_annotations() -> Vec<&'static str> {
    let mut keys = vec![INJECT, IMAGE_ANNOTATION];
    keys.extend(SETTINGS.iter().filter_map(|s| s.annotation));
    keys
}

pub fn setting(var: Var) -> &'static Setting {
    SETTINGS
        .iter()
        .find(|s| s.var == var)
        .unwrap_or(&SETTINGS[0])
}

/// A condition on the resolved settings.
#[derive(Clone, Copy, Debug)]
pub enum Cond {
    Watch,
    File,
    Unix,
    /// The admin port serves `/metrics` to a Prometheus scraping the Pod IP.
    Metrics,
}

/// A piece of the injected objects: literals, resolved settings, conditional list items.
pub enum T {
    Str(&'static str),
    Int(i64),
    Bool(bool),
    Var(Var),
    /// A string made of parts.
    Cat(Vec<T>),
    /// An object of the Kubernetes schema (typed in CEL).
    Map(Vec<(&'static str, T)>),
    /// A map of strings (`resources.requests`): a plain map in CEL.
    Dict(Vec<(&'static str, T)>),
    List(Vec<(Option<Cond>, T)>),
}

fn s(text: &'static str) -> T {
    T::Str(text)
}

fn map<const N: usize>(fields: [(&'static str, T); N]) -> T {
    T::Map(fields.into())
}

fn always(t: T) -> (Option<Cond>, T) {
    (None, t)
}

fn when(c: Cond, t: T) -> (Option<Cond>, T) {
    (Some(c), t)
}

fn field_env(name: &'static str, path: &'static str) -> T {
    map([
        ("name", s(name)),
        (
            "valueFrom",
            map([(
                "fieldRef",
                map([("apiVersion", s("v1")), ("fieldPath", s(path))]),
            )]),
        ),
    ])
}

fn grpc_probe(period: i64, failures: i64) -> T {
    map([
        ("grpc", map([("port", T::Int(7412))])),
        ("periodSeconds", T::Int(period)),
        ("failureThreshold", T::Int(failures)),
    ])
}

/// Where the sidecar's own token is mounted: where kube-rs looks in a Pod.
pub const TOKEN_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The sidecar: a native sidecar (restartPolicy Always) whose startup probe holds the
/// app containers back until it answers. Pod Security "restricted" on its own, whatever
/// the Pod sets.
pub fn sidecar() -> T {
    map([
        ("name", s(SIDECAR)),
        ("image", T::Var(Var::Image)),
        ("imagePullPolicy", s("IfNotPresent")),
        ("restartPolicy", s("Always")),
        (
            "args",
            T::List(vec![
                when(
                    Cond::Watch,
                    T::Cat(vec![
                        s("--configmap=$(POD_NAMESPACE)/"),
                        T::Var(Var::ConfigMap),
                    ]),
                ),
                when(Cond::Watch, s("--pod-name=$(POD_NAME)")),
                when(Cond::File, s("--policies-dir=/etc/rebound")),
                when(Cond::Unix, s("--uds=/run/rebound/rebound.sock")),
                // The socket's directory is the Pod's own emptyDir: any user of the Pod
                // may connect, whatever user the worker runs as.
                when(Cond::Unix, s("--uds-mode=0666")),
                when(Cond::Unix, s("--no-tcp")),
                always(s("--admin-listen=$(POD_IP):7412")),
                // Only the admin port (gRPC health for the kubelet, /metrics when asked) leaves
                // loopback.
                always(s("--allow-non-loopback")),
                when(Cond::Metrics, s("--metrics-beyond-loopback")),
                always(s("--log-format=json")),
            ]),
        ),
        (
            "env",
            T::List(vec![
                always(field_env("POD_NAMESPACE", "metadata.namespace")),
                always(field_env("POD_NAME", "metadata.name")),
                // The owner of the fleet Lease, so it goes with the Pod.
                always(field_env("POD_UID", "metadata.uid")),
                always(field_env("POD_IP", "status.podIP")),
                always(map([
                    ("name", s("RUST_LOG")),
                    ("value", T::Var(Var::LogLevel)),
                ])),
            ]),
        ),
        (
            "ports",
            T::List(vec![always(map([
                ("name", s("rebound-admin")),
                ("containerPort", T::Int(7412)),
                ("protocol", s("TCP")),
            ]))]),
        ),
        ("startupProbe", grpc_probe(1, 30)),
        ("readinessProbe", grpc_probe(10, 3)),
        ("livenessProbe", grpc_probe(20, 3)),
        (
            "resources",
            map([
                (
                    "requests",
                    T::Dict(vec![
                        ("cpu", T::Var(Var::CpuRequest)),
                        ("memory", T::Var(Var::MemoryRequest)),
                    ]),
                ),
                (
                    "limits",
                    T::Dict(vec![("memory", T::Var(Var::MemoryLimit))]),
                ),
            ]),
        ),
        (
            "securityContext",
            map([
                ("runAsNonRoot", T::Bool(true)),
                ("runAsUser", T::Int(65532)),
                ("runAsGroup", T::Int(65532)),
                ("allowPrivilegeEscalation", T::Bool(false)),
                ("readOnlyRootFilesystem", T::Bool(true)),
                (
                    "capabilities",
                    map([("drop", T::List(vec![always(s("ALL"))]))]),
                ),
                ("seccompProfile", map([("type", s("RuntimeDefault"))])),
            ]),
        ),
        (
            "volumeMounts",
            T::List(vec![
                when(
                    Cond::Unix,
                    map([("name", s(SOCKET_VOLUME)), ("mountPath", s(SOCKET_DIR))]),
                ),
                when(
                    Cond::File,
                    map([
                        ("name", s("rebound-policies")),
                        ("mountPath", s("/etc/rebound")),
                        ("readOnly", T::Bool(true)),
                    ]),
                ),
                when(
                    Cond::Watch,
                    map([
                        ("name", s("rebound-sidecar-token")),
                        ("mountPath", s(TOKEN_DIR)),
                        ("readOnly", T::Bool(true)),
                    ]),
                ),
            ]),
        ),
    ])
}

/// The Pod volumes injection adds, in order.
pub fn volumes() -> T {
    T::List(vec![
        when(
            Cond::Unix,
            map([
                ("name", s(SOCKET_VOLUME)),
                (
                    "emptyDir",
                    map([("medium", s("Memory")), ("sizeLimit", s("1Mi"))]),
                ),
            ]),
        ),
        // File mode: the whole ConfigMap, never a subPath (which never sees updates).
        when(
            Cond::File,
            map([
                ("name", s("rebound-policies")),
                ("configMap", map([("name", T::Var(Var::ConfigMap))])),
            ]),
        ),
        // Watch mode: a token for the sidecar only, so the app containers gain no API
        // access, and Pods with automountServiceAccountToken: false still get one.
        when(Cond::Watch, token_volume()),
    ])
}

fn token_volume() -> T {
    let item = |path: &'static str, source: T| map([("path", s(path)), ("fieldRef", source)]);
    map([
        ("name", s("rebound-sidecar-token")),
        (
            "projected",
            map([
                ("defaultMode", T::Int(0o444)),
                (
                    "sources",
                    T::List(vec![
                        always(map([(
                            "serviceAccountToken",
                            map([("path", s("token")), ("expirationSeconds", T::Int(3607))]),
                        )])),
                        always(map([(
                            "configMap",
                            map([
                                ("name", s("kube-root-ca.crt")),
                                (
                                    "items",
                                    T::List(vec![always(map([
                                        ("key", s("ca.crt")),
                                        ("path", s("ca.crt")),
                                    ]))]),
                                ),
                            ]),
                        )])),
                        always(map([(
                            "downwardAPI",
                            map([(
                                "items",
                                T::List(vec![always(item(
                                    "namespace",
                                    map([
                                        ("apiVersion", s("v1")),
                                        ("fieldPath", s("metadata.namespace")),
                                    ]),
                                ))]),
                            )]),
                        )])),
                    ]),
                ),
            ]),
        ),
    ])
}
