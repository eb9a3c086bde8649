/*
 * Prints the layout of the rdma_cm types as the installed rdma-core headers define them:
 * "TYPE size N align N", one "TYPE.FIELD OFFSET SIZE" line per field, then the enum sizes
 * and constants. crates/ibverbs/src/rdmacm/layout.txt is this program's output on Debian
 * 12 (rdma-core 44); the Rust mirrors in crates/ibverbs/src/rdmacm/abi.rs are tested
 * against that file, and tests-ext/rdmacm/run.sh checks that file against this program.
 *
 *   gcc -Wall -Werror -o layout layout.c && ./layout > crates/ibverbs/src/rdmacm/layout.txt
 */
#include <stdalign.h>
#include <stddef.h>
#include <stdio.h>

#include <infiniband/ib.h>
#include <infiniband/sa.h>
#include <rdma/rdma_cma.h>

#define TYPE(t) printf("%s size %zu align %zu\n", #t, sizeof(struct t), alignof(struct t))
#define FIELD(t, f) \
	printf("%s.%s %zu %zu\n", #t, #f, offsetof(struct t, f), sizeof(((struct t *)0)->f))
#define CONST(c) printf("%s %llu\n", #c, (unsigned long long)(c))

int main(void)
{
	TYPE(rdma_ib_addr);
	FIELD(rdma_ib_addr, sgid);
	FIELD(rdma_ib_addr, dgid);
	FIELD(rdma_ib_addr, pkey);

	TYPE(rdma_addr);
	FIELD(rdma_addr, src_addr);
	FIELD(rdma_addr, src_sin);
	FIELD(rdma_addr, src_sin6);
	FIELD(rdma_addr, src_storage);
	FIELD(rdma_addr, dst_addr);
	FIELD(rdma_addr, dst_sin);
	FIELD(rdma_addr, dst_sin6);
	FIELD(rdma_addr, dst_storage);
	FIELD(rdma_addr, addr.ibaddr);

	TYPE(ibv_sa_path_rec);
	FIELD(ibv_sa_path_rec, dgid);
	FIELD(ibv_sa_path_rec, sgid);
	FIELD(ibv_sa_path_rec, dlid);
	FIELD(ibv_sa_path_rec, slid);
	FIELD(ibv_sa_path_rec, raw_traffic);
	FIELD(ibv_sa_path_rec, flow_label);
	FIELD(ibv_sa_path_rec, hop_limit);
	FIELD(ibv_sa_path_rec, traffic_class);
	FIELD(ibv_sa_path_rec, reversible);
	FIELD(ibv_sa_path_rec, numb_path);
	FIELD(ibv_sa_path_rec, pkey);
	FIELD(ibv_sa_path_rec, sl);
	FIELD(ibv_sa_path_rec, mtu_selector);
	FIELD(ibv_sa_path_rec, mtu);
	FIELD(ibv_sa_path_rec, rate_selector);
	FIELD(ibv_sa_path_rec, rate);
	FIELD(ibv_sa_path_rec, packet_life_time_selector);
	FIELD(ibv_sa_path_rec, packet_life_time);
	FIELD(ibv_sa_path_rec, preference);

	TYPE(ibv_path_record);
	FIELD(ibv_path_record, service_id);
	FIELD(ibv_path_record, dgid);
	FIELD(ibv_path_record, sgid);
	FIELD(ibv_path_record, dlid);
	FIELD(ibv_path_record, slid);
	FIELD(ibv_path_record, flowlabel_hoplimit);
	FIELD(ibv_path_record, tclass);
	FIELD(ibv_path_record, reversible_numpath);
	FIELD(ibv_path_record, pkey);
	FIELD(ibv_path_record, qosclass_sl);
	FIELD(ibv_path_record, mtu);
	FIELD(ibv_path_record, rate);
	FIELD(ibv_path_record, packetlifetime);
	FIELD(ibv_path_record, preference);
	FIELD(ibv_path_record, reserved);

	TYPE(ibv_path_data);
	FIELD(ibv_path_data, flags);
	FIELD(ibv_path_data, reserved);
	FIELD(ibv_path_data, path);

	TYPE(rdma_route);
	FIELD(rdma_route, addr);
	FIELD(rdma_route, path_rec);
	FIELD(rdma_route, num_paths);

	TYPE(rdma_event_channel);
	FIELD(rdma_event_channel, fd);

	TYPE(rdma_cm_id);
	FIELD(rdma_cm_id, verbs);
	FIELD(rdma_cm_id, channel);
	FIELD(rdma_cm_id, context);
	FIELD(rdma_cm_id, qp);
	FIELD(rdma_cm_id, route);
	FIELD(rdma_cm_id, ps);
	FIELD(rdma_cm_id, port_num);
	FIELD(rdma_cm_id, event);
	FIELD(rdma_cm_id, send_cq_channel);
	FIELD(rdma_cm_id, send_cq);
	FIELD(rdma_cm_id, recv_cq_channel);
	FIELD(rdma_cm_id, recv_cq);
	FIELD(rdma_cm_id, srq);
	FIELD(rdma_cm_id, pd);
	FIELD(rdma_cm_id, qp_type);

	TYPE(rdma_conn_param);
	FIELD(rdma_conn_param, private_data);
	FIELD(rdma_conn_param, private_data_len);
	FIELD(rdma_conn_param, responder_resources);
	FIELD(rdma_conn_param, initiator_depth);
	FIELD(rdma_conn_param, flow_control);
	FIELD(rdma_conn_param, retry_count);
	FIELD(rdma_conn_param, rnr_retry_count);
	FIELD(rdma_conn_param, srq);
	FIELD(rdma_conn_param, qp_num);

	TYPE(rdma_ud_param);
	FIELD(rdma_ud_param, private_data);
	FIELD(rdma_ud_param, private_data_len);
	FIELD(rdma_ud_param, ah_attr);
	FIELD(rdma_ud_param, qp_num);
	FIELD(rdma_ud_param, qkey);

	TYPE(rdma_cm_event);
	FIELD(rdma_cm_event, id);
	FIELD(rdma_cm_event, listen_id);
	FIELD(rdma_cm_event, event);
	FIELD(rdma_cm_event, status);
	FIELD(rdma_cm_event, param.conn);
	FIELD(rdma_cm_event, param.ud);

	TYPE(rdma_addrinfo);
	FIELD(rdma_addrinfo, ai_flags);
	FIELD(rdma_addrinfo, ai_family);
	FIELD(rdma_addrinfo, ai_qp_type);
	FIELD(rdma_addrinfo, ai_port_space);
	FIELD(rdma_addrinfo, ai_src_len);
	FIELD(rdma_addrinfo, ai_dst_len);
	FIELD(rdma_addrinfo, ai_src_addr);
	FIELD(rdma_addrinfo, ai_dst_addr);
	FIELD(rdma_addrinfo, ai_src_canonname);
	FIELD(rdma_addrinfo, ai_dst_canonname);
	FIELD(rdma_addrinfo, ai_route_len);
	FIELD(rdma_addrinfo, ai_route);
	FIELD(rdma_addrinfo, ai_connect_len);
	FIELD(rdma_addrinfo, ai_connect);
	FIELD(rdma_addrinfo, ai_next);

	TYPE(rdma_cm_join_mc_attr_ex);
	FIELD(rdma_cm_join_mc_attr_ex, comp_mask);
	FIELD(rdma_cm_join_mc_attr_ex, join_flags);
	FIELD(rdma_cm_join_mc_attr_ex, addr);

	TYPE(ib_addr);
	FIELD(ib_addr, ib_u.uib_addr8);
	FIELD(ib_addr, ib_u.uib_addr16);
	FIELD(ib_addr, ib_u.uib_addr32);
	FIELD(ib_addr, ib_u.uib_addr64);

	TYPE(sockaddr_ib);
	FIELD(sockaddr_ib, sib_family);
	FIELD(sockaddr_ib, sib_pkey);
	FIELD(sockaddr_ib, sib_flowinfo);
	FIELD(sockaddr_ib, sib_addr);
	FIELD(sockaddr_ib, sib_sid);
	FIELD(sockaddr_ib, sib_sid_mask);
	FIELD(sockaddr_ib, sib_scope_id);

	printf("enum rdma_cm_event_type size %zu\n", sizeof(enum rdma_cm_event_type));
	printf("enum rdma_port_space size %zu\n", sizeof(enum rdma_port_space));
	CONST(RDMA_CM_EVENT_ADDR_RESOLVED);
	CONST(RDMA_CM_EVENT_ADDR_ERROR);
	CONST(RDMA_CM_EVENT_ROUTE_RESOLVED);
	CONST(RDMA_CM_EVENT_ROUTE_ERROR);
	CONST(RDMA_CM_EVENT_CONNECT_REQUEST);
	CONST(RDMA_CM_EVENT_CONNECT_RESPONSE);
	CONST(RDMA_CM_EVENT_CONNECT_ERROR);
	CONST(RDMA_CM_EVENT_UNREACHABLE);
	CONST(RDMA_CM_EVENT_REJECTED);
	CONST(RDMA_CM_EVENT_ESTABLISHED);
	CONST(RDMA_CM_EVENT_DISCONNECTED);
	CONST(RDMA_CM_EVENT_DEVICE_REMOVAL);
	CONST(RDMA_CM_EVENT_MULTICAST_JOIN);
	CONST(RDMA_CM_EVENT_MULTICAST_ERROR);
	CONST(RDMA_CM_EVENT_ADDR_CHANGE);
	CONST(RDMA_CM_EVENT_TIMEWAIT_EXIT);
	CONST(RDMA_PS_IPOIB);
	CONST(RDMA_PS_TCP);
	CONST(RDMA_PS_UDP);
	CONST(RDMA_PS_IB);
	CONST(RDMA_IB_IP_PS_MASK);
	CONST(RDMA_IB_IP_PORT_MASK);
	CONST(RDMA_IB_IP_PS_TCP);
	CONST(RDMA_IB_IP_PS_UDP);
	CONST(RDMA_IB_PS_IB);
	CONST(RDMA_UDP_QKEY);
	CONST(RDMA_MAX_RESP_RES);
	CONST(RDMA_MAX_INIT_DEPTH);
	CONST(RAI_PASSIVE);
	CONST(RAI_NUMERICHOST);
	CONST(RAI_NOROUTE);
	CONST(RAI_FAMILY);
	CONST(RDMA_OPTION_ID);
	CONST(RDMA_OPTION_IB);
	CONST(RDMA_OPTION_ID_TOS);
	CONST(RDMA_OPTION_ID_REUSEADDR);
	CONST(RDMA_OPTION_ID_AFONLY);
	CONST(RDMA_OPTION_ID_ACK_TIMEOUT);
	CONST(RDMA_OPTION_IB_PATH);
	CONST(RDMA_CM_JOIN_MC_ATTR_ADDRESS);
	CONST(RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS);
	CONST(RDMA_CM_JOIN_MC_ATTR_RESERVED);
	CONST(RDMA_MC_JOIN_FLAG_FULLMEMBER);
	CONST(RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER);
	CONST(RDMA_MC_JOIN_FLAG_RESERVED);
	CONST(AF_IB);
	return 0;
}
