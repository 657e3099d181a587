package idempotency

import (
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	idempotencyv1 "github.com/exactlyonce/idempotency/proto/idempotency/v1"
)

// keyMode is what a method's descriptor says about its key.
type keyMode int

const (
	// modeDefault: nothing in the descriptor; the interceptor's options decide.
	modeDefault keyMode = iota
	// modeRequired: calls without a key are rejected.
	modeRequired
	// modeOptional: calls with a key are protected, others pass through.
	modeOptional
	// modePassThrough: idempotency is off (MODE_DISABLED) or not needed
	// (idempotency_level NO_SIDE_EFFECTS or IDEMPOTENT); keys are ignored.
	modePassThrough
)

// methodPolicy is the resolved idempotency policy of one method.
type methodPolicy struct {
	// known is false when no descriptor of the method was found: not in
	// the global registry (no generated code linked in) nor in the file of
	// the request's type (a hand-written ServiceDesc), or no request was at
	// hand to look there.
	known bool
	mode  keyMode
	// ttl overrides the interceptor's TTL when positive.
	ttl time.Duration
	// keyField is the path to the request's string field holding the key
	// (natural idempotency); keyPath is its dotted name. nil: metadata only.
	keyField []protoreflect.FieldDescriptor
	keyPath  string
	// err is a configuration error in the method's option, reported on
	// every call of the method rather than guessed around.
	err error
	// safeLevel: idempotency_level NO_SIDE_EFFECTS or IDEMPOTENT, or one
	// of gRPC's infrastructure services: a call is safe to repeat.
	safeLevel bool
	// isolation is the level of the method's transactions, "" for the
	// store's.
	isolation pgx.TxIsoLevel
	// responseType is the type the method declares for its response, which
	// a replay decodes the stored response with; nil when not known.
	responseType protoreflect.MessageType
}

// isolationLevels maps the option's isolation to pgx's.
var isolationLevels = map[idempotencyv1.MethodPolicy_Isolation]pgx.TxIsoLevel{
	idempotencyv1.MethodPolicy_ISOLATION_UNSPECIFIED:     "",
	idempotencyv1.MethodPolicy_ISOLATION_READ_COMMITTED:  pgx.ReadCommitted,
	idempotencyv1.MethodPolicy_ISOLATION_REPEATABLE_READ: pgx.RepeatableRead,
	idempotencyv1.MethodPolicy_ISOLATION_SERIALIZABLE:    pgx.Serializable,
}

// methodKey names a method as the calls of one descriptor see it: its full
// name ("/pkg.Service/Method") and the descriptor of its request type, nil
// when no request is at hand. Two descriptors of one method (two versions
// of a service built at run time) are two keys.
type methodKey struct {
	method string
	req    protoreflect.MessageDescriptor
}

// policies caches methodPolicy by methodKey, so descriptors are read once
// per method and request type, not once per call.
var policies sync.Map // methodKey -> methodPolicy

// policyFor returns the policy of fullMethod as the global registry of
// descriptors declares it. Use [policyForRequest] when the request is at
// hand: it also finds services built at run time.
func policyFor(fullMethod string) methodPolicy {
	return cachedPolicy(methodKey{method: fullMethod})
}

// policyForRequest returns the policy of fullMethod for a call with req:
// declared in the file of req's type (a service built at run time, with
// dynamicpb, never in the global registry), else in the global registry;
// its key_field is resolved in req's own descriptor.
func policyForRequest(fullMethod string, req any) methodPolicy {
	m, ok := req.(proto.Message)
	if !ok || m == nil {
		return policyFor(fullMethod)
	}
	return cachedPolicy(methodKey{fullMethod, m.ProtoReflect().Descriptor()})
}

func cachedPolicy(key methodKey) methodPolicy {
	if p, ok := policies.Load(key); ok {
		return p.(methodPolicy)
	}
	p := resolvePolicy(key.method, key.req)
	policies.Store(key, p)
	return p
}

// infrastructureServices are the services of gRPC itself that grpc-go
// registers on an application's server, beside its own: health checking
// (Kubernetes probes, grpc_health_probe, Envoy, load balancers), reflection
// (grpcurl, Postman), channelz and CSDS (admin.Register), ORCA load reports,
// profiling, and the grpclb, RLS and ALTS handshaker protocols. They read
// state or set connections up, are not the application's operations, and
// none of their clients sends a key: their calls pass through, whatever
// the interceptor's options, and the client interceptor sends them none.
var infrastructureServices = map[string]bool{
	"grpc.health.v1.Health":                                true,
	"grpc.reflection.v1.ServerReflection":                  true,
	"grpc.reflection.v1alpha.ServerReflection":             true,
	"grpc.channelz.v1.Channelz":                            true,
	"envoy.service.status.v3.ClientStatusDiscoveryService": true,
	"xds.service.orca.v3.OpenRcaService":                   true,
	"grpc.go.profiling.v1alpha.Profiling":                  true,
	"grpc.lb.v1.LoadBalancer":                              true,
	"grpc.lookup.v1.RouteLookupService":                    true,
	"grpc.gcp.HandshakerService":                           true,
}

// resolvePolicy applies the precedence documented in idempotency.proto:
// the explicit (idempotency.v1.method) option, then idempotency_level, then
// the interceptor's defaults (modeDefault). gRPC's infrastructure services
// come before all of them. req is the request's descriptor, or nil.
func resolvePolicy(fullMethod string, req protoreflect.MessageDescriptor) methodPolicy {
	if svc, _, ok := splitMethod(fullMethod); ok && infrastructureServices[svc] {
		return methodPolicy{known: true, mode: modePassThrough, safeLevel: true}
	}
	md := findMethod(fullMethod, req)
	if md == nil {
		return methodPolicy{}
	}
	p := methodPolicy{known: true, responseType: responseType(md)}
	opts, _ := md.Options().(*descriptorpb.MethodOptions)
	var mp *idempotencyv1.MethodPolicy
	if opts != nil && proto.HasExtension(opts, idempotencyv1.E_Method) {
		mp, _ = proto.GetExtension(opts, idempotencyv1.E_Method).(*idempotencyv1.MethodPolicy)
	}
	switch opts.GetIdempotencyLevel() {
	case descriptorpb.MethodOptions_NO_SIDE_EFFECTS, descriptorpb.MethodOptions_IDEMPOTENT:
		p.safeLevel = true
	}
	switch mp.GetMode() {
	case idempotencyv1.MethodPolicy_MODE_REQUIRED:
		p.mode = modeRequired
	case idempotencyv1.MethodPolicy_MODE_OPTIONAL:
		p.mode = modeOptional
	case idempotencyv1.MethodPolicy_MODE_DISABLED:
		p.mode = modePassThrough
	default:
		if p.safeLevel {
			p.mode = modePassThrough
		}
	}
	if mp == nil || p.mode == modePassThrough {
		return p
	}
	level, ok := isolationLevels[mp.GetIsolation()]
	if !ok {
		p.err = fmt.Errorf("method %s: option (idempotency.v1.method).isolation has the unknown value %d", fullMethod, mp.GetIsolation())
		return p
	}
	p.isolation = level
	if ttl := mp.GetTtl(); ttl != nil {
		if err := ttl.CheckValid(); err != nil || ttl.AsDuration() < 0 {
			p.err = fmt.Errorf("method %s: option (idempotency.v1.method).ttl must be a non-negative duration, got %v", fullMethod, ttl)
			return p
		}
		p.ttl = ttl.AsDuration()
	}
	if path := mp.GetKeyField(); path != "" {
		input := md.Input()
		if req != nil {
			input = req // the fields of the message the call carries
		}
		p.keyField, p.err = resolveKeyField(input, path)
		p.keyPath = path
		if p.err != nil {
			p.err = fmt.Errorf("method %s: option (idempotency.v1.method).key_field: %w", fullMethod, p.err)
		}
	}
	return p
}

// resolveKeyField turns a dotted path such as "meta.request_id" into the
// fields it names: singular messages, then a singular string. A message
// field may be a proto2 group or an editions DELIMITED field (GroupKind):
// only its encoding differs.
func resolveKeyField(msg protoreflect.MessageDescriptor, path string) ([]protoreflect.FieldDescriptor, error) {
	names := strings.Split(path, ".")
	fields := make([]protoreflect.FieldDescriptor, 0, len(names))
	for i, name := range names {
		fd := msg.Fields().ByName(protoreflect.Name(name))
		switch {
		case fd == nil:
			return nil, fmt.Errorf("%s has no field %q (path %q)", msg.FullName(), name, path)
		case fd.IsList() || fd.IsMap():
			return nil, fmt.Errorf("field %s is repeated; the key must be a singular string", fd.FullName())
		case i < len(names)-1 && fd.Message() == nil:
			return nil, fmt.Errorf("field %s is not a message, so %q cannot continue past it", fd.FullName(), path)
		case i == len(names)-1 && fd.Kind() != protoreflect.StringKind:
			return nil, fmt.Errorf("field %s is %s; the key must be a string field", fd.FullName(), fd.Kind())
		}
		fields = append(fields, fd)
		if fd.Message() != nil {
			msg = fd.Message()
		}
	}
	return fields, nil
}

// keyFromField reads the key from the request; "" when a field on the path
// is unset or the string is empty. Unset means missing even when the field
// declares a default (proto2, editions): the default is the same for every
// request, so as a key it would make all of them one call.
func (p methodPolicy) keyFromField(req proto.Message) string {
	m := req.ProtoReflect()
	for _, fd := range p.keyField {
		if !m.Has(fd) {
			return ""
		}
		if fd.Kind() == protoreflect.StringKind {
			return m.Get(fd).String()
		}
		m = m.Get(fd).Message()
	}
	return ""
}

// clientGeneratesKey reports whether the client interceptor should attach a
// generated key to calls of this method.
func (p methodPolicy) clientGeneratesKey(unknownMethodKeys bool) bool {
	switch {
	case !p.known:
		return unknownMethodKeys
	case p.mode == modePassThrough:
		return false
	case p.keyField != nil:
		return false // the request carries its own key
	}
	return true
}

// retrySafeWithoutKey reports whether a call of this method that carries no
// key may still be retried: protobuf marks it safe to repeat, or the request
// carries its own key.
func (p methodPolicy) retrySafeWithoutKey() bool {
	return p.safeLevel || p.keyField != nil
}

// findMethod finds "/pkg.Service/Method" among the services of the file
// that declares req (when not nil), else in the global registry of
// descriptors; nil when neither declares it.
func findMethod(fullMethod string, req protoreflect.MessageDescriptor) protoreflect.MethodDescriptor {
	svc, method, ok := splitMethod(fullMethod)
	if !ok {
		return nil
	}
	if req != nil && req.ParentFile() != nil {
		services := req.ParentFile().Services()
		if sd := services.ByName(protoreflect.FullName(svc).Name()); sd != nil && string(sd.FullName()) == svc {
			return sd.Methods().ByName(protoreflect.Name(method))
		}
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
	if err != nil {
		return nil
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return nil
	}
	return sd.Methods().ByName(protoreflect.Name(method))
}

// splitMethod splits "/pkg.Service/Method" into its service's full name
// and the method's name.
func splitMethod(fullMethod string) (svc, method string, ok bool) {
	return strings.Cut(strings.TrimPrefix(fullMethod, "/"), "/")
}

// responseType returns the type md declares for its response: the
// generated one when it is linked in, else a message type built from the
// descriptor (a service built at run time).
func responseType(md protoreflect.MethodDescriptor) protoreflect.MessageType {
	out := md.Output()
	if linked, err := protoregistry.GlobalTypes.FindMessageByName(out.FullName()); err == nil && linked.Descriptor() == out {
		return linked
	}
	return dynamicpb.NewMessageType(out)
}
