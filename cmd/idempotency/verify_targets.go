package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"syscall"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	rpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/exactlyonce/idempotency"
)

// httpTarget sends an HTTP request with the IETF Idempotency-Key header.
type httpTarget struct {
	cfg         verifyConfig
	client      *http.Client
	body, other []byte
}

func newHTTPTarget(cfg verifyConfig) (*httpTarget, error) {
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.DialContext = (&net.Dialer{Timeout: cfg.timeout, Control: dialControl(cfg.allowRemote)}).DialContext
	t := &httpTarget{cfg: cfg, body: []byte(cfg.body), other: []byte(cfg.otherBody), client: &http.Client{
		Timeout: cfg.timeout, Transport: transport,
		// A redirect is an answer: following it could leave the hosts
		// the target was checked for, and resend the key elsewhere.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}}
	if cfg.otherBody == "" {
		var m map[string]any
		if err := json.Unmarshal([]byte(cfg.body), &m); err != nil {
			return nil, errors.New("-d is not a JSON object: give the key-reused check another body with -other-body")
		}
		m["verify_other"] = strings.ToLower(rand.Text())
		t.other, _ = json.Marshal(m)
	}
	if t.cfg.headers.Get("Content-Type") == "" && json.Valid(t.body) {
		t.cfg.headers.Set("Content-Type", "application/json")
	}
	return t, nil
}

func (t *httpTarget) describe() string {
	if u, err := url.Parse(t.cfg.httpURL); err == nil {
		return t.cfg.httpMethod + " " + u.Redacted()
	}
	return t.cfg.httpMethod + " (the URL given)"
}

func (t *httpTarget) close() { t.client.CloseIdleConnections() }

func (t *httpTarget) send(ctx context.Context, key string, other, caller2 bool) answer {
	body := t.body
	if other {
		body = t.other
	}
	req, err := http.NewRequestWithContext(ctx, t.cfg.httpMethod, t.cfg.httpURL, strings.NewReader(string(body)))
	if err != nil {
		return answer{class: noAnswer, err: err}
	}
	req.Header = t.cfg.headers.Clone()
	if caller2 {
		for name, values := range t.cfg.caller2 {
			req.Header[name] = values
		}
	}
	if key != "" {
		req.Header.Set(idempotency.HeaderKey, key)
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return answer{class: noAnswer, err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{class: noAnswer, err: err}
	}
	// This library's marker: a header of its HTTP middleware, the
	// trailer of connect-go's handler (a Trailer- header in the Connect
	// protocol's unary calls, a real trailer otherwise).
	a := answer{code: strconv.Itoa(resp.StatusCode), class: answered, ok: resp.StatusCode/100 == 2, body: b, replay: resp.Header.Get(idempotency.ReplayedHeader) == "true" ||
		resp.Header.Get("Trailer-"+idempotency.ReplayedTrailer) == "true" || resp.Trailer.Get(idempotency.ReplayedTrailer) == "true"}
	// This library's own answers say which they are (problem+json's
	// "reason"); a stored answer is marked as a replay. Without either, a
	// 409 and a 422 are the IETF draft's.
	var problem struct {
		Reason string `json:"reason"`
	}
	_ = json.Unmarshal(b, &problem)
	a.reason = problem.Reason
	// The Connect protocol sends an error as JSON with its code, on an
	// HTTP status that codes share (failed_precondition is a 400).
	var connectErr struct {
		Code string `json:"code"`
	}
	if resp.StatusCode >= 400 && strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") &&
		json.Unmarshal(b, &connectErr) == nil && connectErr.Code != "" {
		a.code = strconv.Itoa(resp.StatusCode) + " " + connectErr.Code
		switch connectErr.Code {
		case "aborted":
			if !a.replay {
				a.class = inProgress
			}
		case "failed_precondition":
			if !a.replay {
				a.class = keyReused
			}
		case "invalid_argument":
			if key == "" {
				a.class = keyRefused
			}
		case "unavailable", "internal", "unknown", "deadline_exceeded", "resource_exhausted":
			a.class = failed
		}
		return a
	}
	switch s := resp.StatusCode; {
	case (s == http.StatusConflict || s == http.StatusUnprocessableEntity) && (a.replay || (problem.Reason != "" && !strings.HasPrefix(problem.Reason, "KEY_"))):
		// the service's own answer, stored
	case s == http.StatusConflict:
		a.class = inProgress
	case s == http.StatusUnprocessableEntity:
		a.class = keyReused
	case s == http.StatusBadRequest && (key == "" || strings.Contains(string(b), idempotency.HeaderKey)):
		a.class = keyRefused
	case s >= 500 || s == http.StatusTooManyRequests || s == http.StatusRequestTimeout:
		a.class = failed
	}
	return a
}

// grpcTarget invokes a unary method with the metadata key idempotency-key,
// its request and response built from the method's descriptors.
type grpcTarget struct {
	cfg        verifyConfig
	conn       *grpc.ClientConn
	method     protoreflect.MethodDescriptor
	req, other proto.Message
}

func newGRPCTarget(ctx context.Context, cfg verifyConfig) (*grpcTarget, error) {
	dialer := &net.Dialer{Timeout: cfg.timeout, Control: dialControl(cfg.allowRemote)}
	conn, err := grpc.NewClient("passthrough:///"+cfg.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) { return dialer.DialContext(ctx, "tcp", addr) }))
	if err != nil {
		return nil, err
	}
	t := &grpcTarget{cfg: cfg, conn: conn}
	service, name, ok := strings.Cut(strings.TrimPrefix(cfg.grpcMethod, "/"), "/")
	if !ok || service == "" || name == "" {
		conn.Close()
		return nil, fmt.Errorf("-method %q is not /pkg.Service/Method", cfg.grpcMethod)
	}
	files, err := t.descriptors(ctx, service)
	if err != nil {
		conn.Close()
		return nil, err
	}
	d, err := files.FindDescriptorByName(protoreflect.FullName(service))
	sd, _ := d.(protoreflect.ServiceDescriptor)
	if err != nil || sd == nil {
		conn.Close()
		return nil, fmt.Errorf("service %s is not in the descriptors", service)
	}
	if t.method = sd.Methods().ByName(protoreflect.Name(name)); t.method == nil || t.method.IsStreamingClient() || t.method.IsStreamingServer() {
		conn.Close()
		return nil, fmt.Errorf("%s has no unary method %s", service, name)
	}
	resolver := dynamicpb.NewTypes(files)
	parse := func(flagName, text string) (proto.Message, error) {
		m := dynamicpb.NewMessage(t.method.Input())
		if err := (protojson.UnmarshalOptions{Resolver: resolver}).Unmarshal([]byte(text), m); err != nil {
			return nil, fmt.Errorf("%s: not a %s in protobuf JSON: %v", flagName, t.method.Input().FullName(), err)
		}
		return m, nil
	}
	if t.req, err = parse("-request", cfg.request); err == nil {
		if cfg.otherRequest != "" {
			t.other, err = parse("-other-request", cfg.otherRequest)
		} else if t.other, err = changed(t.req); err != nil {
			err = fmt.Errorf("%v: give the key-reused check another request with -other-request", err)
		}
	}
	if err != nil {
		conn.Close()
		return nil, err
	}
	return t, nil
}

// descriptors are the files of -proto-descriptors, else the server's, by
// reflection.
func (t *grpcTarget) descriptors(ctx context.Context, service string) (*protoregistry.Files, error) {
	if len(t.cfg.descriptorFiles) > 0 {
		return loadProtoFiles(t.cfg.descriptorFiles)
	}
	stream, err := rpb.NewServerReflectionClient(t.conn).ServerReflectionInfo(ctx)
	if err == nil {
		err = stream.Send(&rpb.ServerReflectionRequest{MessageRequest: &rpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: service}})
	}
	var resp *rpb.ServerReflectionResponse
	if err == nil {
		resp, err = stream.Recv()
		_ = stream.CloseSend()
	}
	if err != nil {
		return nil, fmt.Errorf("the server's descriptors by reflection: %v (register grpc reflection on the server, or give -proto-descriptors FILE: %s)", err, descriptorsHelp)
	}
	if e := resp.GetErrorResponse(); e != nil {
		return nil, fmt.Errorf("the server's reflection: %s", e.GetErrorMessage())
	}
	var fdps []*descriptorpb.FileDescriptorProto
	for _, b := range resp.GetFileDescriptorResponse().GetFileDescriptorProto() {
		fdp := &descriptorpb.FileDescriptorProto{}
		if err := proto.Unmarshal(b, fdp); err != nil {
			return nil, fmt.Errorf("the server's reflection: %v", err)
		}
		fdps = append(fdps, fdp)
	}
	files, err := registerFiles(fdps)
	if err != nil {
		return nil, fmt.Errorf("the server's reflection: %v", err)
	}
	return files, nil
}

// changed is m with its first string field set to another value, or its
// first number changed.
func changed(m proto.Message) (proto.Message, error) {
	c := proto.Clone(m)
	fields := c.ProtoReflect().Descriptor().Fields()
	for i := range fields.Len() {
		f := fields.Get(i)
		if f.IsList() || f.IsMap() {
			continue
		}
		r := c.ProtoReflect()
		switch f.Kind() {
		case protoreflect.StringKind:
			r.Set(f, protoreflect.ValueOfString(r.Get(f).String()+" verify-other"))
			return c, nil
		case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
			r.Set(f, protoreflect.ValueOfInt64(r.Get(f).Int()+1))
			return c, nil
		case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
			r.Set(f, protoreflect.ValueOfInt32(int32(r.Get(f).Int())+1))
			return c, nil
		}
	}
	return nil, errors.New("the request has no string or integer field to change")
}

func (t *grpcTarget) describe() string { return "gRPC " + t.cfg.grpcAddr + " " + t.cfg.grpcMethod }

func (t *grpcTarget) close() { _ = t.conn.Close() }

func (t *grpcTarget) send(ctx context.Context, key string, other, caller2 bool) answer {
	req := t.req
	if other {
		req = t.other
	}
	md := metadata.MD{}
	for name, values := range t.cfg.headers {
		md.Set(strings.ToLower(name), values...)
	}
	if caller2 {
		for name, values := range t.cfg.caller2 {
			md.Set(strings.ToLower(name), values...)
		}
	}
	if key != "" {
		md.Set(idempotency.MetadataKey, key)
	}
	ctx, cancel := context.WithTimeout(metadata.NewOutgoingContext(ctx, md), t.cfg.timeout)
	defer cancel()
	resp := dynamicpb.NewMessage(t.method.Output())
	var trailer metadata.MD
	err := t.conn.Invoke(ctx, t.cfg.grpcMethod, req, resp, grpc.Trailer(&trailer))
	a := answer{class: answered, replay: len(trailer.Get(idempotency.ReplayedTrailer)) > 0 && trailer.Get(idempotency.ReplayedTrailer)[0] == "true"}
	st, isStatus := status.FromError(err)
	switch {
	case err == nil:
		a.code, a.ok = "OK", true
		a.body, _ = proto.MarshalOptions{Deterministic: true}.Marshal(resp)
		return a
	case !isStatus:
		a.class, a.err = noAnswer, err
		return a
	}
	a.code = st.Code().String()
	a.body, _ = proto.MarshalOptions{Deterministic: true}.Marshal(st.Proto())
	reason := ""
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			reason = info.GetReason()
		}
	}
	// This library's own answers carry an ErrorInfo reason, and a stored
	// answer is marked as a replay; without either, Aborted and
	// FailedPrecondition are taken as a key's.
	a.reason = reason
	ours := a.replay || (reason != "" && !strings.HasPrefix(reason, "KEY_"))
	switch c := st.Code(); {
	case c == codes.Aborted && !ours:
		a.class = inProgress
	case reason == "KEY_REUSED" || (c == codes.FailedPrecondition && !ours):
		a.class = keyReused
	case c == codes.InvalidArgument && (key == "" || strings.HasPrefix(reason, "KEY_")):
		a.class = keyRefused
	case c == codes.Unavailable || c == codes.DeadlineExceeded || c == codes.ResourceExhausted || c == codes.Internal || c == codes.Unknown:
		a.class = failed
	}
	return a
}

// dialControl refuses, unless remote targets are allowed, a connection to
// an address off loopback and private networks, whatever the name it was
// made for resolved to when the target was checked.
func dialControl(allowRemote bool) func(network, address string, _ syscall.RawConn) error {
	return func(network, address string, _ syscall.RawConn) error {
		if allowRemote {
			return nil
		}
		host, _, err := net.SplitHostPort(address)
		if err != nil {
			return err
		}
		ip := net.ParseIP(host)
		if ip == nil || (!ip.IsLoopback() && !ip.IsPrivate()) {
			return fmt.Errorf("refused to connect to %s, which is not on loopback or a private network (-allow-remote)", address)
		}
		return nil
	}
}
