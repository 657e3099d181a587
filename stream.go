package idempotency

import (
	"fmt"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// Streaming calls are not protected by this package: the engine stores one
// response per key, and a stream has many (and a client-streaming request is
// not known until its last message). Rather than pass such calls through as
// if they were protected, the stream interceptor refuses every one that asks
// for protection, and CheckStreamingMethods finds the annotated ones at
// startup.

// StreamServerInterceptor returns a server interceptor for streaming calls.
// Streaming methods are not protected by this package, so it refuses, with
// codes.Unimplemented ([ErrStreamingUnsupported]) and before the handler
// runs, every streaming call that asks for protection: one whose method the
// (idempotency.v1.method) option annotates (MODE_REQUIRED, MODE_OPTIONAL, a
// key_field, a ttl or an isolation), and one that carries an idempotency key
// ("idempotency-key" or "idempotency-key-bin"). Every other streaming call
// passes untouched: a method without the option, called without a key, and
// a method with MODE_DISABLED or idempotency_level NO_SIDE_EFFECTS or
// IDEMPOTENT (whose keys are ignored, as for unary calls).
//
// Install it beside [UnaryServerInterceptor], with the same store and
// options (kept for when streams are supported), and check the server with
// [CheckStreamingMethods] once its services are registered.
//
// It panics if store is nil or an option is invalid.
func StreamServerInterceptor(store *Store, opts ...ServerOption) grpc.StreamServerInterceptor {
	_ = mustServerOptions("StreamServerInterceptor", store, opts) // kept for when streams are supported
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		pol := policyFor(info.FullMethod)
		md, _ := metadata.FromIncomingContext(ss.Context())
		if err := refuseStream(md, info.FullMethod, pol); err != nil {
			return err
		}
		if !pol.known {
			// Not in the global registry: a service built at run time is
			// described by the file of its request type, known with the
			// first message, which every handler reads before it acts.
			ss = &firstMessageCheck{ServerStream: ss, method: info.FullMethod}
		}
		return handler(srv, ss)
	}
}

// firstMessageCheck refuses a stream, at its first message, whose method
// the request's own file annotates.
type firstMessageCheck struct {
	grpc.ServerStream
	method  string
	checked bool
	err     error
}

func (f *firstMessageCheck) RecvMsg(m any) error {
	if f.err != nil {
		return f.err
	}
	err := f.ServerStream.RecvMsg(m)
	if err != nil || f.checked {
		return err
	}
	f.checked = true
	if pol := policyForRequest(f.method, m); pol.known {
		md, _ := metadata.FromIncomingContext(f.Context())
		f.err = refuseStream(md, f.method, pol)
	}
	return f.err
}

// CheckStreamingMethods returns an error ([ErrStreamingUnsupported]) naming
// every streaming method registered on srv (a *grpc.Server) whose
// descriptor asks for idempotency keys with the (idempotency.v1.method)
// option, which this package cannot honour; nil when there is none. Call it
// at startup, after registering the services and before serving, and stop
// on an error: [StreamServerInterceptor] would refuse every call of those
// methods.
//
//	if err := idempotency.CheckStreamingMethods(srv); err != nil {
//		log.Fatal(err)
//	}
func CheckStreamingMethods(srv interface {
	GetServiceInfo() map[string]grpc.ServiceInfo
}) error {
	var bad []string
	for svc, si := range srv.GetServiceInfo() {
		for _, m := range si.Methods {
			method := "/" + svc + "/" + m.Name
			if (m.IsClientStream || m.IsServerStream) && streamAnnotated(policyFor(method)) {
				bad = append(bad, method)
			}
		}
	}
	if len(bad) == 0 {
		return nil
	}
	slices.Sort(bad)
	return ErrStreamingUnsupported.with("these streaming methods are annotated with (idempotency.v1.method): "+strings.Join(bad, ", ")+"; remove the option or set mode: MODE_DISABLED", nil)
}

// refuseStream returns the error for a streaming call that asks for
// protection, nil for one that passes.
func refuseStream(md metadata.MD, method string, pol methodPolicy) error {
	if streamAnnotated(pol) {
		return ErrStreamingUnsupported.with(method+" is annotated with (idempotency.v1.method), which streaming methods cannot honour; remove the option or set mode: MODE_DISABLED", nil)
	}
	if pol.mode == modePassThrough && pol.err == nil {
		return nil // keys are ignored, as for unary calls
	}
	for _, k := range []string{MetadataKey, binaryMetadataKey} {
		if len(md.Get(k)) > 0 {
			return ErrStreamingUnsupported.with(fmt.Sprintf("%s is a streaming method and the call carries %s; send it without a key", method, k), nil).about(k)
		}
	}
	return nil
}

// streamAnnotated reports whether a method's policy asks for keys: its
// (idempotency.v1.method) option sets anything that matters unless the call
// is passed through.
func streamAnnotated(pol methodPolicy) bool {
	switch {
	case pol.mode == modePassThrough && pol.err == nil:
		return false
	case pol.mode == modeRequired || pol.mode == modeOptional:
		return true
	}
	return pol.keyField != nil || pol.ttl > 0 || pol.isolation != "" || pol.err != nil
}
