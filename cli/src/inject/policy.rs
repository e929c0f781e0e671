//! The admission policies, compiled from `spec`: a MutatingAdmissionPolicy that injects
//! inside the API server (no webhook), and a ValidatingAdmissionPolicy that refuses
//! unknown or malformed `rebound.dev/*` annotations, naming them. `rebound inject
//! --admission-policy` prints them; the chart commits the output.

use std::fmt::Write as _;

use super::spec::{self, Cond, SETTINGS, T};

/// Where the manifests go: the chart (Helm expressions) or plain YAML for a namespace.
pub enum Flavor<'a> {
    Chart,
    Plain { namespace: &'a str },
}

impl Flavor<'_> {
    fn prefix(&self) -> &str {
        match self {
            Flavor::Chart => "{{ include \"rebound.sidecarName\" . }}",
            Flavor::Plain { .. } => "rebound-sidecar",
        }
    }

    fn namespace(&self) -> &str {
        match self {
            Flavor::Chart => "{{ .Release.Namespace }}",
            Flavor::Plain { namespace } => namespace,
        }
    }

    fn labels(&self) -> &str {
        match self {
            Flavor::Chart => "    {{- include \"rebound.labels\" . | nindent 4 }}",
            Flavor::Plain { .. } => "    app.kubernetes.io/part-of: rebound",
        }
    }
}

/// A CEL string literal.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\\', "\\\\").replace('\'', "\\'"))
}

fn cond(c: Cond) -> &'static str {
    match c {
        Cond::Watch => "variables.mode == 'watch'",
        Cond::File => "variables.mode == 'file'",
        Cond::Unix => "variables.transport == 'unix'",
        Cond::Metrics => "variables.metrics == 'true'",
    }
}

/// CEL for a piece of `spec` whose schema type is `ty` (`Object.spec.initContainers`):
/// objects are typed (CEL refuses maps of mixed values), one field per line.
fn cel(t: &T, ty: &str, indent: usize) -> String {
    let pad = "  ".repeat(indent + 1);
    let close = "  ".repeat(indent);
    match t {
        T::Str(s) => quote(s),
        T::Int(i) => i.to_string(),
        T::Bool(b) => b.to_string(),
        T::Var(v) => format!("variables.{}", spec::setting(*v).name),
        T::Cat(parts) => parts
            .iter()
            .map(|p| cel(p, ty, indent))
            .collect::<Vec<_>>()
            .join(" + "),
        T::Map(fields) => {
            let body: Vec<String> = fields
                .iter()
                .map(|(k, v)| format!("{pad}{k}: {}", cel(v, &format!("{ty}.{k}"), indent + 1)))
                .collect();
            format!("{ty}{{\n{}\n{close}}}", body.join(",\n"))
        }
        T::Dict(fields) => {
            let body: Vec<String> = fields
                .iter()
                .map(|(k, v)| format!("{}: {}", quote(k), cel(v, ty, indent + 1)))
                .collect();
            format!("{{{}}}", body.join(", "))
        }
        T::List(items) => {
            let mut parts = Vec::new();
            let mut run: Vec<String> = Vec::new();
            for (c, item) in items {
                let text = cel(item, ty, indent);
                match c {
                    None => run.push(text),
                    Some(c) => {
                        if !run.is_empty() {
                            parts.push(format!("[{}]", run.join(", ")));
                            run.clear();
                        }
                        parts.push(format!("({} ? [{text}] : [])", cond(*c)));
                    }
                }
            }
            if !run.is_empty() || parts.is_empty() {
                parts.push(format!("[{}]", run.join(", ")));
            }
            parts.join(" + ")
        }
    }
}

fn annotation(key: &str) -> String {
    format!("object.metadata.?annotations[?{}]", quote(key))
}

/// Who asks for injection. The namespace label is matched by a binding's
/// namespaceSelector (match conditions do not see the namespace), so each way of asking
/// has its policies and bindings, from the same code.
#[derive(Clone, Copy)]
enum Scope {
    /// `rebound.dev/inject` on the Pod, other than "false".
    Annotation,
    /// No `rebound.dev/inject` on the Pod, in a namespace labelled rebound.dev/inject=enabled.
    Namespace,
}

/// The admission policies `rebound inject --admission-policy` writes, as (kind, name) for
/// the sidecar name `prefix` (`<release>-sidecar` in the chart); each has a binding of the
/// same name. `rebound check` looks for exactly these.
pub fn policy_names(prefix: &str) -> Vec<(&'static str, String)> {
    [Scope::Annotation, Scope::Namespace]
        .into_iter()
        .flat_map(|scope| {
            let name = format!("{prefix}-{}", scope.suffix());
            let overrides = format!("{name}-overrides");
            [
                ("MutatingAdmissionPolicy", name),
                ("ValidatingAdmissionPolicy", overrides),
            ]
        })
        .collect()
}

impl Scope {
    fn suffix(self) -> &'static str {
        match self {
            Scope::Annotation => "inject",
            Scope::Namespace => "inject-namespace",
        }
    }

    fn asked(self) -> String {
        let a = annotation(spec::INJECT);
        match self {
            Scope::Annotation => format!("{a}.hasValue() && {a}.value() != 'false'"),
            Scope::Namespace => format!("!{a}.hasValue()"),
        }
    }
}

/// Not injected yet: no injected label, no sidecar among the init containers.
fn not_injected() -> String {
    format!(
        "!(object.metadata.?labels[?{}].orValue('') == 'true' ||\n  \
         object.spec.?initContainers.orValue([]).exists(c, c.name == {}))",
        quote(spec::INJECTED_LABEL),
        quote(spec::SIDECAR)
    )
}

/// One check of an annotation: its key, the CEL that holds when it is fine, the CEL
/// message (which starts with the key, as `render::InjectError` does).
struct Check {
    expression: String,
    message: String,
}

fn value_check(key: &str, pattern: &str, expected: &str) -> Check {
    let a = annotation(key);
    Check {
        expression: format!("!{a}.hasValue() || {a}.value().matches({})", quote(pattern)),
        message: format!(
            "{} + {a}.orValue('') + '\"'",
            quote(&format!("{key}: must be {expected}, not \""))
        ),
    }
}

fn checks() -> Vec<Check> {
    let known: Vec<String> = spec::known_annotations().iter().map(|k| quote(k)).collect();
    let known = format!("[{}]", known.join(", "));
    let unknown = format!("k.startsWith('rebound.dev/') && !(k in {known})");
    let mut out = vec![
        value_check(spec::INJECT, spec::INJECT_PATTERN, spec::INJECT_EXPECTED),
        Check {
            expression: format!("!object.metadata.?annotations.orValue({{}}).exists(k, {unknown})"),
            message: format!(
                "object.metadata.annotations.filter(k, {unknown})[0] + {}",
                quote(&format!(
                    ": unknown annotation; known: {}",
                    spec::known_annotations().join(", ")
                ))
            ),
        },
    ];
    for s in &SETTINGS {
        if let Some(key) = s.annotation {
            out.push(value_check(key, s.pattern, s.expected));
        }
    }
    out
}

/// Last: a Pod that asked, has valid overrides and still reached validation without the
/// sidecar was not injected (no parameters, no mutating policy): refused, never started
/// without its sidecar.
fn missing_sidecar(flavor: &Flavor) -> Check {
    Check {
        expression: format!(
            "object.spec.?initContainers.orValue([]).exists(c, c.name == {})",
            quote(spec::SIDECAR)
        ),
        message: quote(&format!(
            "{}: the sidecar was not injected: the parameters (ConfigMap {}/{}) or the \
             MutatingAdmissionPolicy are missing",
            spec::INJECT,
            flavor.namespace(),
            spec::PARAMS_CONFIGMAP
        )),
    }
}

/// Each setting: the annotation, else the parameter, else the default.
fn setting_expression(s: &spec::Setting) -> String {
    let mut value = quote(s.default);
    if let Some(param) = s.param {
        value = format!("params.?data[?{}].orValue({value})", quote(param));
    }
    if let Some(key) = s.annotation {
        value = format!("{}.orValue({value})", annotation(key));
    }
    value
}

/// Creates each missing list or map first, so that every addition has one path.
fn json_patch() -> String {
    let add =
        |path: &str, value: &str| format!("JSONPatch{{op: 'add', path: '{path}', value: {value}}}");
    let ensure = |field: &str, path: &str, empty: &str| {
        format!("(has({field}) ? [] : [{}])", add(path, empty))
    };
    let sidecar = cel(&spec::sidecar(), "Object.spec.initContainers", 1);
    let volumes = cel(&spec::volumes(), "Object.spec.volumes", 1);
    [
        ensure("object.spec.initContainers", "/spec/initContainers", "[]"),
        format!("[{}]", add("/spec/initContainers/0", &sidecar)),
        ensure("object.spec.volumes", "/spec/volumes", "[]"),
        format!("({volumes}).map(v, {})", add("/spec/volumes/-", "v")),
        ensure("object.metadata.labels", "/metadata/labels", "{}"),
        format!(
            "[{}]",
            add("/metadata/labels/rebound.dev~1injected", "'true'")
        ),
        ensure("object.metadata.annotations", "/metadata/annotations", "{}"),
        format!(
            "[{}]",
            add(
                "/metadata/annotations/rebound.dev~1sidecar-image",
                "variables.image"
            )
        ),
    ]
    .join(" +\n")
}

/// The app containers: `REBOUND_TARGET` unless set, the socket mount unless the path is
/// taken. Server-side-apply semantics merge these into each container by name.
fn apply_containers() -> String {
    format!(
        "Object{{spec: Object.spec{{containers: object.spec.containers.map(c,\n  \
         Object.spec.containers{{\n    name: c.name,\n    \
         ?env: c.?env.orValue([]).exists(e, e.name == {target_env}) ? optional.none() :\n      \
         optional.of([Object.spec.containers.env{{name: {target_env}, value: variables.target}}]),\n    \
         ?volumeMounts: (variables.transport != 'unix' ||\n        \
         c.?volumeMounts.orValue([]).exists(m, m.mountPath == {dir})) ? optional.none() :\n      \
         optional.of([Object.spec.containers.volumeMounts{{name: {volume}, mountPath: {dir}}}])\n  \
         }})}}}}",
        target_env = quote(spec::TARGET_ENV),
        dir = quote(spec::SOCKET_DIR),
        volume = quote(spec::SOCKET_VOLUME),
    )
}

/// Writes `key: |-` and the text indented below it.
fn block(out: &mut String, indent: usize, key: &str, text: &str) {
    let pad = " ".repeat(indent);
    let inner = " ".repeat(indent + if key.starts_with("- ") { 4 } else { 2 });
    let _ = writeln!(out, "{pad}{key}: |-");
    for line in text.lines() {
        let _ = writeln!(out, "{inner}{line}");
    }
}

fn match_pods(out: &mut String) {
    out.push_str(
        "  matchConstraints:\n    resourceRules:\n      - apiGroups: [\"\"]\n        \
         apiVersions: [\"v1\"]\n        operations: [\"CREATE\"]\n        resources: [\"pods\"]\n",
    );
}

fn header(out: &mut String, flavor: &Flavor, kind: &str, name: &str) {
    let _ = writeln!(
        out,
        "apiVersion: admissionregistration.k8s.io/v1\nkind: {kind}\nmetadata:\n  name: {name}\n  labels:\n{}",
        flavor.labels()
    );
}

fn exclusions(out: &mut String, flavor: &Flavor, scope: Scope) {
    let _ = writeln!(
        out,
        "  # Never in kube-system nor in Rebound's own namespace.\n  matchResources:\n    \
         namespaceSelector:\n      matchExpressions:\n        - key: kubernetes.io/metadata.name\n          \
         operator: NotIn\n          values: [kube-system, {}]",
        flavor.namespace()
    );
    if let Scope::Namespace = scope {
        let _ = writeln!(
            out,
            "        - key: {}\n          operator: In\n          values: [enabled]",
            spec::NAMESPACE_LABEL
        );
    }
}

/// The four manifests (policies and bindings) of both scopes as one multi-document YAML
/// text.
pub fn manifests(flavor: &Flavor) -> String {
    let mut out = String::new();
    if let Flavor::Chart = flavor {
        out.push_str("{{- if .Values.injection.enabled }}\n");
    }
    out.push_str(
        "# Generated by `rebound inject --admission-policy` from the code of `rebound inject`;\n\
         # do not edit. Injects the sidecar into Pods annotated rebound.dev/inject: \"true\" (or\n\
         # in namespaces labelled rebound.dev/inject=enabled) inside the API server, with the\n\
         # parameters of the ConfigMap rebound-injection. Only such Pods match: others are\n\
         # never touched, so failurePolicy Fail blocks nothing else. Parameters missing: the\n\
         # binding is skipped (parameterNotFoundAction: Allow; Deny would refuse every Pod,\n\
         # as params are resolved before matchConditions) and the ValidatingAdmissionPolicy\n\
         # refuses the annotated Pod rather than let it start without its sidecar.\n",
    );
    let docs: Vec<String> = [Scope::Annotation, Scope::Namespace]
        .into_iter()
        .map(|scope| scoped(flavor, scope))
        .collect();
    out.push_str(&docs.join("---\n"));
    if let Flavor::Chart = flavor {
        out.push_str("{{- end }}\n");
    }
    out
}

fn scoped(flavor: &Flavor, scope: Scope) -> String {
    let name = format!("{}-{}", flavor.prefix(), scope.suffix());
    let mut out = String::new();
    header(&mut out, flavor, "MutatingAdmissionPolicy", &name);
    out.push_str(
        "spec:\n  failurePolicy: Fail\n  reinvocationPolicy: Never\n  paramKind:\n    \
         apiVersion: v1\n    kind: ConfigMap\n",
    );
    match_pods(&mut out);
    out.push_str("  matchConditions:\n");
    let valid: Vec<String> = checks()
        .into_iter()
        .map(|c| format!("({})", c.expression))
        .collect();
    for (condition, expression) in [
        ("asked", scope.asked()),
        ("not-injected", not_injected()),
        // Malformed overrides are left to the ValidatingAdmissionPolicy, which names them.
        ("overrides-valid", valid.join(" &&\n")),
    ] {
        let _ = writeln!(out, "    - name: {condition}");
        block(&mut out, 6, "expression", &expression);
    }
    out.push_str("  variables:\n");
    for s in &SETTINGS {
        let _ = writeln!(out, "    - name: {}", s.name);
        block(&mut out, 6, "expression", &setting_expression(s));
    }
    let target = format!(
        "variables.transport == 'unix' ? {} : {}",
        quote(spec::UNIX_TARGET),
        quote(spec::TCP_TARGET)
    );
    out.push_str("    - name: target\n");
    block(&mut out, 6, "expression", &target);
    out.push_str(
        "  mutations:\n    # The sidecar first among the init containers: a JSON patch keeps the order.\n",
    );
    out.push_str("    - patchType: JSONPatch\n      jsonPatch:\n");
    block(&mut out, 8, "expression", &json_patch());
    out.push_str("    - patchType: ApplyConfiguration\n      applyConfiguration:\n");
    block(&mut out, 8, "expression", &apply_containers());
    out.push_str("---\n");
    header(&mut out, flavor, "MutatingAdmissionPolicyBinding", &name);
    let _ = writeln!(
        out,
        "spec:\n  policyName: {name}\n  paramRef:\n    name: {}\n    namespace: {}\n    \
         parameterNotFoundAction: Allow",
        spec::PARAMS_CONFIGMAP,
        flavor.namespace()
    );
    exclusions(&mut out, flavor, scope);
    out.push_str(
        "---\n# Refuses Pods asking for injection with an unknown or malformed rebound.dev/*\n\
         # annotation; the message starts with the annotation's name.\n",
    );
    let overrides = format!("{name}-overrides");
    header(&mut out, flavor, "ValidatingAdmissionPolicy", &overrides);
    out.push_str("spec:\n  failurePolicy: Fail\n");
    match_pods(&mut out);
    out.push_str("  matchConditions:\n");
    for (condition, expression) in [("asked", scope.asked()), ("not-injected", not_injected())] {
        let _ = writeln!(out, "    - name: {condition}");
        block(&mut out, 6, "expression", &expression);
    }
    out.push_str("  validations:\n");
    let mut all = checks();
    all.push(missing_sidecar(flavor));
    for check in all {
        block(&mut out, 4, "- expression", &check.expression);
        block(&mut out, 6, "messageExpression", &check.message);
        out.push_str("      reason: Invalid\n");
    }
    out.push_str("---\n");
    header(
        &mut out,
        flavor,
        "ValidatingAdmissionPolicyBinding",
        &overrides,
    );
    let _ = writeln!(
        out,
        "spec:\n  policyName: {overrides}\n  validationActions: [Deny]"
    );
    exclusions(&mut out, flavor, scope);
    out
}
